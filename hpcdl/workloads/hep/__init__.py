"""The HEP workload (after Kurth et al., SC17): RPV-SUSY vs QCD classification of calorimeter images."""
