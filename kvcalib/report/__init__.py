"""Stage 5, what people look at: figures (plots) and the model card (card). Each result's
table is its own summary() (the stages' summary.py)."""
