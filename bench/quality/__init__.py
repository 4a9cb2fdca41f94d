"""Quality evidence for the benchmark: the negative controls and the training-stack verdict with its report."""
