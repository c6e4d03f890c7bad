"""What the modules compute: the plain-JAX reference ops (`reference`), fp8 quantisation (`quant`), the
op table that picks a reference or a kernel for each call (`table`) and the layer the ops get
(`layer`)."""
