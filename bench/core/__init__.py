"""The benchmark's library: the job runner and its worker, result rows, timing, scenarios, profiler and Nsight
Compute plumbing. No module here imports a command of :mod:`bench`."""
