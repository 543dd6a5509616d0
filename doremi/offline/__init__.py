"""The offline search: small runs over designed mixtures (sweep), fits of loss against the mixture (fit/), and the mixture they propose."""
