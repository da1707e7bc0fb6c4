"""Training of the target and the draft models: `common` (samples, loop, checkpoints), `teacher` (cached target
beams and logits for draft alignment), `target` (`train_target`), `draft` (`train_draft`)."""
