"""Training a KAME front-end from recorded dialogues: the data stages (prepare, oracles, tokens),
then training, evaluation and export. Each stage reads and writes files under one run folder."""
