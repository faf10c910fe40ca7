"""Ray: starting or joining a cluster, kept on loopback for local runs."""
