"""VRAM Fit's engine: budgets, cost models, planners, offload, peak tracking, tiled/chunked executors.

Importable and unit-testable without ComfyUI: anything from ``comfy`` is passed in by ``nodes/``. Nothing
is imported here (no import-time side effects). One layer per subpackage, imports only going down:
base modules (``tiles``, ``oom``, ``store``, ``report``, ``budget``, ``offload``, ``geometry``) <
``measure`` < ``vae`` < ``executors`` < ``cost`` < ``plan`` < ``decode``. See docs/ARCHITECTURE.md.
"""
