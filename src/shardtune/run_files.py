"""The names of the files shardtune writes into a run's output_dir, defined once (a leaf module)."""

RESOLVED_CONFIG = "shardtune_config.json"  # the config the run trained with; export reads it
RESULTS = "train_results.json"
LOG = "trainer_log.jsonl"
LOSS_PLOT = "training_loss.png"
TRAINER_STATE = "trainer_state.json"  # in each checkpoint-<step>
LAUNCH_PLAN = ".shardtune/launch_config.json"  # the launching host's resolved plan, read by every rank
RANK_ERROR = ".shardtune/rank-{rank}-error.txt"
NODE_MARKER = ".shardtune/node-check/node-{node}"  # written by each node, read by node 0: is output_dir shared?
RUN_TOKEN = ".shardtune/run-token"  # written by rank 0 at the start of training, read by every rank
