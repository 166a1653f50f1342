"""Evaluation harness (design.md §7, §8): workloads, replay, simulator, metrics, comparison, reports.

``eval`` sits at the top of the dependency direction and may import anything. Nothing happens on
import; import the submodules (``eval.workloads``, ``eval.metrics``) directly.
"""
