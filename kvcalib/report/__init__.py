"""Stage 5, what people and pipelines see: each result as a summary of tables
(summaries), JUnit XML (tables) and figures (plots)."""
