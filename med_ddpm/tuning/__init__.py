"""Tuning a few-step sampler for one checkpoint (``python -m med_ddpm.tune``): its options and resumable state
(:mod:`.state`), the held-out gate of one budget (:mod:`.gate`), the search-and-gate run that stops at the first
passing budget (:mod:`.run`) and its result files (:mod:`.report`). It sits above :mod:`med_ddpm.samplers` and
:mod:`med_ddpm.quality`, both of which it runs."""
