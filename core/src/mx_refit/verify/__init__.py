"""``mx-refit verify`` and its process harness.

* :mod:`mx_refit.verify.tool`: the command (publish a checkpoint from real Megatron ranks, refit it
  into receivers, compare byte for byte).
* :mod:`mx_refit.verify.expect`: the independent expectations it compares against (checkpoint
  bytes, vLLM-style windows), computed without the planner.
* :mod:`mx_refit.verify.harness`: Megatron-Core ranks on one machine for the tool, the demo and
  the tests (``init_distributed``, ``build_model_from_hf``, ``launch_ranks``, ``rendezvous_url``, the
  CPU shims).
"""
