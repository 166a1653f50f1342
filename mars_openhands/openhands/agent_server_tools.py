"""Import this module in an OpenHands agent-server process to get MARS tool events and sessions.

``python -m openhands.agent_server --import-modules mars_openhands.openhands.agent_server_tools``
has the same effect as ``python -m mars_openhands.openhands.agent_server`` (the documented entry
point, :mod:`mars_openhands.openhands.agent_server`): the stock tool modules are imported first,
then ``terminal``, ``file_editor`` and ``task_tracker`` are re-registered with the evented,
policy-checked versions of :mod:`mars_openhands.openhands.executor`, and each conversation is
tracked for ``session_start`` / ``session_end``. Configured from the environment:

* ``MARS_EVENTS_URL``: the gateway's ``http://host:port/mars/v1/events`` (events are posted there);
* ``MARS_EVENTS_PATH``: optional JSONL file the events are also appended to;
* ``MARS_POLICY``: ``on`` (default) or ``off``;
* ``MARS_SESSION_POLL_S``: seconds between conversation status reads (default 0.2).

The session id is the conversation id, which the SDK also sends with every LLM request
(``x-litellm-session-id``), so the gateway joins tool events and LLM turns without client changes.
Importing has this one side effect (registration).

Raises:
    ValueError: at import, a malformed ``MARS_SESSION_POLL_S`` or ``MARS_POLICY``.
"""

from __future__ import annotations

from mars_openhands.openhands.agent_server import install

LIFECYCLE = install()
"""The session lifecycle the stock-named tools of this process report to."""
