"""The names of the files shardtune writes into a run's output_dir, defined once (a leaf module)."""

RESOLVED_CONFIG = "shardtune_config.json"  # the config the run trained with; export reads it
RESULTS = "train_results.json"
LOG = "trainer_log.jsonl"
LOSS_PLOT = "training_loss.png"
TRAINER_STATE = "trainer_state.json"  # in each checkpoint-<step>
LAUNCH_PLAN = ".shardtune/launch_config.json"  # the launching host's resolved plan, read by every rank
RANK_ERROR = ".shardtune/rank-{rank}-error.txt"
