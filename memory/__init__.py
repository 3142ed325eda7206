"""VRAM Fit's engine: budgets, cost model, planner, offload, peak tracking, tiled/chunked executors.

Importable and unit-testable without ComfyUI: anything from ``comfy`` is passed in by ``nodes/``.
Nothing is imported here (no import-time side effects); import the submodules:

* ``tracker``: ``PeakTracker`` (peak bytes of a block), ``measure_peak``, ``tracker_factory``;
* ``geometry``: ``VaeGeometry``, ``Geometry`` (one decoder pass), ``FEATURES``;
* ``cost_model``: ``CostModel``, ``ModelKey``, ``calibrate``, ``fit_model``, ``CostModelStore``;
* ``sizing``: ``decode_run``, ``MetaSizer`` (compute-free sizing on fake tensors);
* ``families``: ``FAMILIES``, ``identify``, ``vae_geometry``;
* ``calibration``: ``calibrate_vae``, ``cost_model_for``, ``fit_grid``, ``real_grid``;
* ``planner``: ``plan_decode``, ``Plan``, ``ImpossibleBudgetError``;
* ``budget``: ``compute_budget``, ``Budget``;
* ``offload``: ``offload_for_decode``, ``OffloadReport``, dynamic-VRAM residency;
* ``self_check``: first-use exactness check of an executor against the host's own decode;
* ``json_store``: the atomic, versioned JSON file behind the persisted stores;
* executors: ``tiled_exact``, ``tiled_generic``, ``video_chunked``; orchestration: ``image_decode``,
  ``video_decode``.

See docs/MEMORY.md.
"""
