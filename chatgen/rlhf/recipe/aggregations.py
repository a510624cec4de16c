"""Loss aggregations, `runtime.algorithm.loss_aggregation`: fn(per_token (B, T), mask (B, T),
norm_length) -> the scalar loss (verl's loss_agg_mode; docs/algorithms.md)."""

from chatgen.rlhf import losses as L
from chatgen.rlhf.recipe.registry import aggregation

aggregation("token_mean")(L.token_mean)
aggregation("seq_mean_token_mean")(L.seq_mean_token_mean)
aggregation("seq_mean_token_sum")(L.seq_mean_token_sum)
aggregation("seq_mean_token_sum_norm")(L.seq_mean_token_sum_norm)
