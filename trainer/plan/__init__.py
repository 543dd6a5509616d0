"""What a config will do on the hardware, decided before anything is built: precision, stage split, memory and layout."""
