"""The climate workload (after Kurth et al., SC17 and Racah et al., NIPS 2017): semi-supervised
detection of extreme weather events (tropical depressions and cyclones, extratropical cyclones,
atmospheric rivers) in 16-channel climate-model fields, in the ExtremeWeather HDF5 layout."""
