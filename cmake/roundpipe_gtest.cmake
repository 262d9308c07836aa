# roundpipe_find_gtest(<out_var>): makes GTest::gtest available, from an installed GoogleTest
# (Debian's libgtest-dev; native builds) or else from its sources, ROUNDPIPE_GTEST_SOURCE_DIR
# (default /usr/src/googletest, which cross builds use). Sets <out_var> to "" when found, or to
# a sentence saying what is missing.
set(ROUNDPIPE_GTEST_SOURCE_DIR "/usr/src/googletest" CACHE PATH "GoogleTest sources")

function(roundpipe_find_gtest out_var)
  if(TARGET GTest::gtest)
    set(${out_var} "" PARENT_SCOPE)
    return()
  endif()
  find_package(GTest QUIET)
  if(GTest_FOUND)
    set(${out_var} "" PARENT_SCOPE)
    return()
  endif()
  if(NOT EXISTS "${ROUNDPIPE_GTEST_SOURCE_DIR}/CMakeLists.txt")
    set(${out_var} "GoogleTest not found: no installed package, no sources in ${ROUNDPIPE_GTEST_SOURCE_DIR}"
        PARENT_SCOPE)
    return()
  endif()
  set(INSTALL_GTEST OFF CACHE BOOL "" FORCE)
  set(BUILD_GMOCK OFF CACHE BOOL "" FORCE)
  add_subdirectory("${ROUNDPIPE_GTEST_SOURCE_DIR}" googletest EXCLUDE_FROM_ALL)
  if(NOT TARGET GTest::gtest)  # GoogleTest >= 1.11 defines the alias itself
    add_library(GTest::gtest ALIAS gtest)
  endif()
  set(${out_var} "" PARENT_SCOPE)
endfunction()
