"""Pre-flight check of an LLM endpoint before any task or app conversation starts (httpx only).

Without it, an unreachable URL cost each task ~38 s of LLM retries before it failed, and a plain
vLLM server behind ``--backend mars`` answered every event post with 404 while the task said
"finished".
"""

from __future__ import annotations

from mars_openhands.cli_style import redact_url

__all__ = ["preflight"]


def preflight(base_url: str, api_key: str = "EMPTY", backend: str = "mars", flag: str = "--url",
              timeout_s: float = 5.0) -> None:
    """Check that the endpoint answers, takes the key, and for ``mars`` is a MARS gateway
    (``GET /mars/v1/healthz``) with a healthy replica.

    Args:
        base_url: the endpoint root, with or without ``/v1``.
        api_key: sent as ``Authorization: Bearer``.
        backend: ``mars`` also checks the gateway; ``vllm`` / ``url`` only reachability and key.
        flag: the flag the URL came from, named in the messages.
        timeout_s: per request, seconds.

    Raises:
        ValueError: one line naming the URL (its password hidden), what it answered and the
            flag to change.
    """
    import httpx

    root = base_url.rstrip("/").removesuffix("/v1")
    shown = redact_url(root)  # the messages' URL: a password in it stays hidden
    headers = {"authorization": f"Bearer {api_key}"}
    try:
        with httpx.Client(timeout=timeout_s, headers=headers) as client:
            models = client.get(f"{root}/v1/models")
            health = client.get(f"{root}/mars/v1/healthz") if backend == "mars" else None
    except httpx.HTTPError as e:
        raise ValueError(f"{flag} {shown}: cannot reach it ({type(e).__name__}: "
                         f"{redact_url(str(e)) or 'no answer'}); "
                         "is the server running there?") from None
    if models.status_code in (401, 403):
        raise ValueError(f"{flag} {shown}: GET /v1/models answered {models.status_code}; check "
                         "--api-key (or $MARS_API_KEY)")
    if health is None:
        return
    try:
        body = health.json()
    except ValueError:
        body = None
    if not isinstance(body, dict) or "healthy_replicas" not in body:
        raise ValueError(f"--backend mars: {shown} is not a MARS gateway (GET /mars/v1/healthz "
                         f"answered {health.status_code}); use --backend vllm for a vLLM server, "
                         "--backend url for another endpoint")
    if health.status_code != 200:
        raise ValueError(f"--backend mars: the gateway at {shown} has no healthy replica "
                         f"({body.get('status')}); start its engines first")
