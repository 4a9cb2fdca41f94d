"""The evidence pages of ``python -m bench.report publish=true``: one run per GPU folder, rendered, never typed.

:mod:`.evidence` picks a folder's run and reads its figures, :mod:`.verdicts` finds the quality verdict beside
each, :mod:`.gpu_page` renders one GPU's page and the README's table, :mod:`.gpus_page` the GPUs side by side,
:mod:`.publish` writes them.
"""
