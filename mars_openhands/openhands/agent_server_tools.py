"""Import this module in the OpenHands agent-server (or app) process to get MARS tool events.

It re-registers ``terminal``, ``file_editor`` and ``task_tracker`` with the evented, policy-checked
versions of :mod:`mars_openhands.openhands.executor`, configured from the environment:

* ``MARS_EVENTS_URL``: the gateway's ``http://host:port/mars/v1/events`` (events are posted there);
* ``MARS_EVENTS_PATH``: optional JSONL file the events are also appended to;
* ``MARS_POLICY``: ``on`` (default) or ``off``.

The session id is the conversation id, which SDK >= 1.58 also sends with every LLM request
(``x-litellm-session-id``), so the gateway joins tool events and LLM turns without client changes.
Importing has this one side effect (registration); it is idempotent.
"""

from __future__ import annotations

from mars_openhands.openhands.executor import register_evented_tools

REGISTERED = register_evented_tools(override_defaults=True)
"""spec name → tool name registered at import."""
