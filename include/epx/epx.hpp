// epx/epx.hpp - everything a C++ user includes.
#pragma once

#include "epx/buffer.hpp"
#include "epx/config.hpp"
#include "epx/dtype.hpp"
#include "epx/error.hpp"
#include "epx/event.hpp"
#include "epx/tensor.hpp"
#include "epx/version.hpp"
