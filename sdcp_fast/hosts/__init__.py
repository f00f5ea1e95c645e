"""Test hosts (issue 36): a deployment on network namespaces with addresses of their own,
a 3-member etcd cluster, and a relay that puts a delay between drafters and the verifier.
Modules: netns (hosts, links, cleanup), reaper, etcd_cluster, deployment (HostCluster),
relay (the delay relay), testbed (all of them together)."""
