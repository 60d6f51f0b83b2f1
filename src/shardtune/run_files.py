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
RANK_LOG = "ranks/rank_{rank}.jsonl"  # one line per step of each rank (train/rank_log.py)
RUN_LOCK = ".shardtune/run.lock"  # the live run's holder and heartbeat (launch/run_lock.py)
LAUNCH_COMMANDS = ".shardtune/launch_commands.json"  # the command line and each node's torchrun command
WEB_LAUNCH = ".shardtune/web_launch.json"  # a run started from `shardtune web`: its process and console log
CONSOLE_LOG = ".shardtune/console.log"  # stdout and stderr of a run started from `shardtune web`
STOP_REPORT = ".shardtune/stop.json"  # what a Stop from `shardtune web` did to each process
