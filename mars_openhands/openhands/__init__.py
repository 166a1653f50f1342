"""OpenHands adapter (design.md §10): per-session LLM config, evented tool executors with a pre-tool
policy check, a runner with the ``--backend mars|vllm|url`` flag, and a playback engine.

The only package that imports the OpenHands SDK (Python >= 3.12). Importing this package does nothing;
import the submodules (``llm``, ``executor``, ``policy_check``, ``runner``, ``playback``, ``cli``).
"""
