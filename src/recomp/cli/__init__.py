"""``recomp bench``: measure activation memory, replayed work and step time of checkpointing
strategies side by side, on a built-in Llama-style decoder or on a user's model.

Also home of ``recomp plan`` (``plan_cli``), which profiles, plans and measures a plan with
the same child processes; the planner itself is ``recomp.plan``, a library this package
uses and that never imports it.

Nothing here is imported by ``import recomp``; ``python -m recomp bench`` loads it lazily.
The modules that import a framework (``models``, ``strategies``, ``measure`` for PyTorch;
``ms_models``, ``ms_runner`` for MindSpore) run inside child processes, one per
measurement, so that allocator readings of one strategy never see another's memory.
"""
