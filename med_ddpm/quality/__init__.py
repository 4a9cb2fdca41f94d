"""Sample quality: features and metrics, their statistics, the speed-vs-quality gate and the runs it judges
(:mod:`.probe`), and the comparison of two folders of volumes (:mod:`.evaluate`)."""
