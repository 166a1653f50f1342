"""Multi-node serving on Ray Serve: N vLLM replicas with our scheduler plugins behind the MARS gateway.

``mars-openhands serve`` (:mod:`~mars_openhands.serve.cli`) builds one Ray Serve application
(:mod:`~mars_openhands.serve.app`): one engine deployment per replica
(:mod:`~mars_openhands.serve.engine`: a vLLM OpenAI server with a MARS scheduler class, restarted
by Ray when it dies) and an ingress deployment (:mod:`~mars_openhands.serve.ingress`) holding the
gateway's :class:`~mars_openhands.control.plane.ControlPlane` (admission, reorder, routing) and
serving the gateway's OpenAI-compatible endpoint and ``/mars/v1/*`` routes. A
:class:`~mars_openhands.serve.router.SessionRequestRouter` routes Serve-native traffic by session
with the same :class:`~mars_openhands.control.routing.Router`. docs/serve.md has the whole picture.

The only layer that imports Ray (``tests/unit/test_layering.py``). Importing this package imports
neither Ray nor vLLM.
"""
