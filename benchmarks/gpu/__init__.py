"""The GPU check (`bash benchmarks/gpu_check.sh`, docs/bench/GPU.md): a prepared, time-boxed run of kvserve's
kernels, engine steps and serving numbers on a lent GPU. `check` plans and runs the steps, `steps` holds them,
`models` the shapes they run, `measure` the timing, `context` what the steps share, `env` the machine's facts, `wheels`
the offline wheels the device lacks."""
