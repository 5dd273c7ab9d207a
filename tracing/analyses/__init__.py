"""What a trace can answer beyond its recorded values: direct logit attribution (attribution), the
contribution graph (flow), what each head read (heads), the indexer's recall of dense attention
(recall), how near each routing came to another choice (margins), interventions on a run
(interventions), the comparison of two traces (diff) and the held-out loss of a text (evaluate)."""
