"""Scale-out on Ray: one host actor per node (its pool, CRIU and workspaces), a snapshot index
fed by the hosts, prefix-aware placement of GRPO groups, snapshot migration between hosts, and
hosts that die losing only their own rollouts. See :mod:`bunshin_gym.cluster.cluster`."""

from bunshin_gym.cluster.cluster import BunshinCluster, GroupResult, GroupSpec, Migration, start_local_ray
from bunshin_gym.cluster.host import HostActor, IndexEntry, WorkspaceHandle
from bunshin_gym.cluster.index import Match, SnapshotIndex
from bunshin_gym.cluster.placement import Decision, Placer
from bunshin_gym.cluster.replay import ReplayPolicy
from bunshin_gym.cluster.vector import ClusterGroupVectorEnv, HostLost

__all__ = ["BunshinCluster", "ClusterGroupVectorEnv", "Decision", "GroupResult", "GroupSpec", "HostActor", "HostLost",
           "IndexEntry", "Match", "Migration", "Placer", "ReplayPolicy", "SnapshotIndex", "WorkspaceHandle",
           "start_local_ray"]
