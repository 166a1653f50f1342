"""The harness: running real vLLM schedulers without a GPU (design.md §9).

Not part of the vLLM plugin (``engine/schedulers``, ``engine/seams``, ``plugin.py``,
``telemetry.py``, ``queues.py``): nothing there imports this package. Two ways to run:

* in process, no model and no server (the simulator and the engine tests):
  :mod:`.inproc_engine` (``InprocEngine``: a real scheduler over a fake KV cache, answered with
  synthetic model outputs);
* a real vLLM server on a machine without the GPU: :mod:`.executor` (``EmulatedGPUExecutor``,
  ``--distributed-executor-backend mars_openhands.engine.EmulatedGPUExecutor``, and the GPU
  step-time model the simulator shares), :mod:`.launch` (``VllmServer``: start, wait, stop) and
  :mod:`.tiny_model` (a download-free model directory).

Nothing heavy is imported here: import the submodules you need.
"""
