"""The worker: what runs the model for the engine core, one per tensor-parallel rank. `model_runner.py` applies each
`SchedulerOutput` to the persistent rows (`input_batch.py`), flattens them into one step's inputs (`step_inputs.py`),
runs the forward (eagerly or replaying `cuda_graphs.py`) and samples (`sampler.py`, with grammar masks from
`structured_output.py` and prompt scoring from `prompt_logprobs.py`).
"""
