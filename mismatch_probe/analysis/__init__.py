"""Metrics over the per-token table: streaming accumulators (``metrics``), histograms and worst
sequences (``distributions``), the analysis pass over the shards (``analyze``) and the metric
registry with each metric's definition (``metric_docs``). Pure computation over arrays; no rendering.
"""
