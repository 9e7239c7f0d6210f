"""The generic workload: the user's own `tf.keras.Model` (a builder function) on arrays in HDF5 files."""
