"""The planted-fact recall probe (`kvtax recall`): transcripts, facts, models, grading."""
