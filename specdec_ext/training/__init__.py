"""Training the acceptance head (above the engine: it generates data with it): data sets
(``head_data``), draft features (``head_features``), training and metrics (``head_train``), the offline
goodput replay (``replay``) and the pipeline behind ``specdec train-head`` (``pipeline``)."""
