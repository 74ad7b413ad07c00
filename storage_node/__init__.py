"""The storage node: block pool, UCX server and inventory publisher."""
