from tpmk.partition.loader import LoadStats, load_shard
from tpmk.partition.plan import ShardPlan, TensorShard, build_shard_plan, shard_state_dict
from tpmk.partition.weights import RankWeights, local_heads, padded_vocab
