"""Metric dicts: combining the figures of several micro-batches, ranks or steps into one."""


def reduce_metrics(parts: list) -> dict:
    """One dict of metrics from the dicts of several micro-batches, ranks or steps: a name ending
    in `_max` takes the largest value, every other name the mean."""
    return {
        k: max(p[k] for p in parts) if k.endswith("_max") else sum(p[k] for p in parts) / len(parts)
        for k in parts[0]
    }
