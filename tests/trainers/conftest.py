"""Tests of recomp inside the trainers large models are trained with: Megatron-Core,
DeepSpeed, Lightning, TRL. They run in the trainers' environment (`make test-trainers`,
requirements/trainers.txt); elsewhere each file skips itself when its trainer is not
installed. Support code a trainer needs on CPU (Megatron's CUDA shims) lives in these
tests, never in recomp."""
