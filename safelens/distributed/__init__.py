"""Dataset jobs sharded across Ray workers, one model replica per worker (`safelens[ray]`)."""
