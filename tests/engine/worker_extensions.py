"""Worker extension classes (vLLM's `worker_extension_cls`) the tests load by name."""

from __future__ import annotations

import torch


class WeightTools:
    """Methods an RL framework adds to every rank's worker."""

    def param_sum(self) -> float:
        return float(sum(p.double().sum() for p in self.model_runner.model.parameters()))

    def scale_norms(self, factor: float) -> int:
        """Multiply every norm weight by `factor`; the count changed (a weight update)."""
        n = 0
        with torch.no_grad():
            for name, p in self.model_runner.model.named_parameters():
                if "norm" in name:
                    p.mul_(factor)
                    n += 1
        return n


class Clashing:
    def execute_model(self, sched):  # the worker's own method
        raise AssertionError("never runs")
