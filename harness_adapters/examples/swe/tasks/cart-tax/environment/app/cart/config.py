TAX_PERCENT = 8  # sales tax, in per cent
