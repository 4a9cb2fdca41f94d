"""The evidence pages of ``python -m bench.report publish=true``: one run per GPU folder, rendered, never typed.

:mod:`.evidence` picks a folder's run and reads its figures (the counters against the study's claims included),
:mod:`.verdicts` finds the quality verdict beside each, :mod:`.pages` renders each GPU's page, the GPUs side by side
and the README's table, and writes them.
"""
