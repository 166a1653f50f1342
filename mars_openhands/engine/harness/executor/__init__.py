"""Emulated-GPU executor plugin and its GPU step-time model (design.md §9).

* :mod:`.profiles`: which GPU × model × dtype is emulated, its calibration and KV capacity.
* :mod:`.timing`: :class:`~.timing.StepTimeModel`, a pure step-time model from NVIDIA
  AIConfigurator's measured kernel data (also used by the simulator).
* :mod:`.emulated`: ``EmulatedGPUExecutor``, the ``--distributed-executor-backend`` plugin that
  waits the modelled time instead of running a model.

Nothing heavy is imported here: import the submodules you need.
"""
