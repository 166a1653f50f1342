"""Scheduler plugins (``--scheduler-cls mars_openhands.engine.MarsScheduler`` etc.).

Import the classes through :mod:`mars_openhands.engine` (lazy) or their modules directly.
"""
