"""The Tinker API on forge's actors (`forge serve`): the `tinker` SDK and tinker-cookbook loops
drive forge's trainer and samplers; see docs/tinker.md."""
