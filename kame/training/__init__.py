"""`kame train`: from recorded dialogues to a KAME front-end checkpoint (data stages, trainer, export)."""
