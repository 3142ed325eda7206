"""VRAM Fit's engine: budgets, cost model, planner, offload, peak tracking, tiled/chunked executors.

Importable and unit-testable without ComfyUI: anything from ``comfy`` is passed in by ``nodes/``.
"""
