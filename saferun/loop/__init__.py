"""The training loop's machinery: loop state, batch stream, step helpers, metrics, precision,
compilation checks and seeding. `saferun.trainer.Trainer` reads top to bottom over these."""
