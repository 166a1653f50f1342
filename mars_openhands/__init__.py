"""mars-openhands: MARS co-scheduling for agentic LLM workloads on stock vLLM and OpenHands.

Nothing happens on import; see `docs/structure.md` for the map of the package.
"""

__version__ = "0.1.0"
