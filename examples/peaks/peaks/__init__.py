"""An example of hpcdl's generic Keras workload: where is the peak in a noisy image, and how high?"""
