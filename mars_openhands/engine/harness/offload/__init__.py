"""vLLM's host-memory KV tier (``--kv-offloading-backend native``) with emulated copies.

vLLM's own scheduler side (``OffloadingConnector``, its ``CPUOffloadingManager`` with LRU / ARC
and the host capacity) runs unchanged; only the worker side's copies are emulated, through
vLLM's public ``spec_module_path`` plug point (:mod:`.spec`): each copy takes ``bytes /
bandwidth`` of virtual time per direction (:mod:`.copies`), and an engine step that overlaps a
copy runs slower. Parameters and their sources: :mod:`.params`; the worker side the in-process
engine and the emulated executor drive: :mod:`.worker_side`. docs/timing.md "Host-memory KV tier".
"""

from mars_openhands.engine.harness.offload.params import HostKvParams

__all__ = ["HostKvParams"]
